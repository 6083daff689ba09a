"""docs/guide.md is executed: every code block in it runs, in order, in a scratch folder
with no PYTHONPATH (see markdown_runner), so the guide cannot drift from the code."""

from __future__ import annotations

import pytest
from markdown_runner import blocks, run_markdown
from serverproc import REPO

GUIDE = REPO / "docs" / "guide.md"


def test_every_block_of_the_guide_is_marked():
    assert len(blocks(GUIDE.read_text())) >= 10


@pytest.mark.slow
def test_the_guide_runs(tmp_path):
    assert run_markdown(GUIDE, tmp_path) == 1  # it runs a server
