"""Every folder of examples/ runs: its README's code blocks are executed in order in a
copy of the folder (see markdown_runner), against the real server and, for the agent,
the bundled scripted model over loopback HTTP."""

from __future__ import annotations

import shutil

import pytest
from markdown_runner import blocks, run_markdown
from serverproc import REPO

EXAMPLES = sorted(p for p in (REPO / "examples").iterdir() if p.is_dir())


def test_there_are_at_least_three_examples_each_with_boot_xml_code_and_readme():
    assert len(EXAMPLES) >= 3
    for folder in EXAMPLES:
        assert (folder / "boot.xml").is_file(), folder
        assert (folder / "README.md").is_file(), folder
        assert list(folder.glob("*.py")), folder
        assert blocks((folder / "README.md").read_text()), folder


@pytest.mark.slow
@pytest.mark.parametrize("folder", EXAMPLES, ids=lambda p: p.name)
def test_the_example_runs_as_its_readme_says(folder, tmp_path):
    work = tmp_path / folder.name
    shutil.copytree(folder, work, ignore=shutil.ignore_patterns("state", "__pycache__"))
    assert run_markdown(work / "README.md", work) >= 1
