from pathlib import Path

from agentserver.agents.store.states import render_markdown
from agentserver.agents.turn.machine import render_markdown as turn_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def test_doc_state_table_matches_the_code():
    text = DOC.read_text()
    begin, end = "<!-- states:begin -->\n", "<!-- states:end -->"
    embedded = text[text.index(begin) + len(begin) : text.index(end)]
    assert embedded.strip() == render_markdown().strip()


def test_doc_turn_machine_table_matches_the_code():
    text = DOC.read_text()
    begin, end = "<!-- turn-machine:begin -->\n", "<!-- turn-machine:end -->"
    embedded = text[text.index(begin) + len(begin) : text.index(end)]
    assert embedded.strip() == turn_table().strip()
