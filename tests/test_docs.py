"""The documentation is true to the repository: docs/architecture.md covers every
module, no document refers to one that is not here, docs/agents.md's defaults are the
code's, and the packaging files say what pyproject says."""

from __future__ import annotations

import re
import tomllib

from serverproc import REPO

from agentserver.agents.profile.agent import AgentProfile

DOCS = sorted((REPO / "docs").glob("*.md"))
READMES = [REPO / "README.md", *sorted((REPO / "examples").glob("**/README.md"))]


def modules() -> list[str]:
    found = []
    for folder in ("agentserver", "listeners", "primitives"):
        for path in sorted((REPO / folder).rglob("*.py")):
            found.append(path.relative_to(REPO).as_posix())
    return found


def test_architecture_covers_every_module():
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = [m for m in modules() if f"`{m}`" not in text]
    assert missing == [], f"docs/architecture.md does not describe {missing}"
    assert "## Layers" in text and "## Where do I change X" in text


def test_no_document_refers_to_one_that_is_not_in_the_repository():
    for doc in [*DOCS, *READMES, REPO / "CHANGELOG.md"]:
        text = doc.read_text()
        for ref in re.findall(r"\bdocs/[a-z0-9_-]+\.md\b", text):
            assert (REPO / ref).is_file(), f"{doc.name} refers to {ref}"
        assert "shared/" not in text, f"{doc.name} refers to shared/ (not in the repository)"
        assert not re.search(r"\bseeds?\b \d{3}", text), f"{doc.name} cites a seed"


def test_agents_doc_default_system_prompt_is_the_code_s():
    text = (REPO / "docs" / "agents.md").read_text()
    defaults = text[text.index("Every setting, with its default:") :]
    prompt = re.search(r"<system-prompt>(.*?)</system-prompt>", defaults)[1]
    assert prompt == AgentProfile.__dataclass_fields__["system_prompt"].default


def test_packaging_files():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()
    assert any(d.startswith("prompt_toolkit") for d in project["dependencies"])
    docker = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:[\d.]+-slim$", docker, re.M)
    user = re.search(r"^USER (\S+)$", docker, re.M)[1]
    assert user not in ("root", "0")
    assert '["agentserver", "run"]' in docker and re.search(r"^VOLUME ", docker, re.M)
    for name in (
        "AGENTSERVER_HOST",
        "AGENTSERVER_PORT",
        "AGENTSERVER_BOOT",
        "AGENTSERVER_LOG_LEVEL",
    ):
        assert name in docker


def test_readme_mentions_schemas_guide_examples_and_the_venv_python_for_benchmarks():
    readme = (REPO / "README.md").read_text()
    assert "agentserver schemas" in readme
    assert "docs/guide.md" in readme and "examples/" in readme
    benches = re.findall(r"(\S*python\S*) bench/", readme)
    assert benches and all(b.endswith(".venv/bin/python") for b in benches), benches
    for name in (
        "AGENTSERVER_HOST",
        "AGENTSERVER_PORT",
        "AGENTSERVER_BOOT",
        "AGENTSERVER_LOG_LEVEL",
    ):
        assert name in readme


def test_no_document_names_a_module_file_that_is_not_there():
    # Modules move (the layer packages, docs/architecture.md): a doc naming the old file
    # sends its reader nowhere. The changelog is history and keeps the names of its day.
    for doc in [*DOCS, *READMES]:
        for ref in re.findall(
            r"\b(?:agentserver|listeners|primitives)/[a-z_/]+\.py\b", doc.read_text()
        ):
            assert (REPO / ref).is_file(), f"{doc.relative_to(REPO)} names {ref}"


def test_the_http_api_reference_is_its_own_page_linked_from_the_readme():
    page = (REPO / "docs" / "http-api.md").read_text()
    assert page.startswith("# HTTP API reference\n")
    for route in ("## `POST /v1/messages?to=NAME`", "## `GET /v1/status` and `agentserver status`"):
        assert route in page
    assert "docs/http-api.md" in (REPO / "README.md").read_text()
    operations = (REPO / "docs" / "operations.md").read_text()
    assert "/v1/messages?to=NAME`\n" not in operations and "docs/http-api.md" in operations
    for doc in [*DOCS, *READMES]:
        assert 'operations.md, "HTTP API reference"' not in doc.read_text(), doc.name
