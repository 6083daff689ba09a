from pathlib import Path

from agentserver.agents.store.states import render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def test_doc_state_table_matches_the_code():
    text = DOC.read_text()
    begin, end = "<!-- states:begin -->\n", "<!-- states:end -->"
    embedded = text[text.index(begin) + len(begin) : text.index(end)]
    assert embedded.strip() == render_markdown().strip()
