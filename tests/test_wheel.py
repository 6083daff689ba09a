"""The wheel users install is whole: every package and data file of the source tree is in it.

``pyproject.toml`` once listed packages by hand and the wheel lacked
``agentserver.http.routes``: every boot.xml with ``<http>`` failed outside an editable
checkout, and no test noticed because every test ran against the checkout. This test
builds the wheel as ``pip install .`` does (from a copy of exactly what the Dockerfile
copies, so the image's build is covered too) and compares its contents with the source
tree. ``.ci/wheel-smoke`` then installs that wheel into a fresh environment and runs it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from serverproc import REPO

#: What the Dockerfile copies into its build (``COPY``): the build needs nothing else.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
#: Source folder -> the installed package path it becomes.
SOURCE_TREE = {
    "agentserver": "agentserver",
    "listeners": "agentserver/listeners",
    "primitives": "agentserver/primitives",
    "schemas": "agentserver/schemas",
}


def source_files() -> set[str]:
    """Every file of the source tree, as its path inside the wheel (caches excluded)."""
    found = set()
    for folder, installed in SOURCE_TREE.items():
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                found.add(f"{installed}/{path.relative_to(REPO / folder).as_posix()}")
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, src / name)
    for folder in SOURCE_TREE:
        shutil.copytree(
            REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    out = tmp_path_factory.mktemp("dist")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip_wheel, "-q", "--wheel-dir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (built,) = out.glob("agentserver-*.whl")
    return built


def test_the_wheel_holds_every_package_and_data_file(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        inside = {n for n in zf.namelist() if not n.startswith("agentserver-")}
    expected = source_files()
    assert "agentserver/http/routes/__init__.py" in expected  # the scan sees the tree
    assert "agentserver/schemas/envelope.xsd" in expected
    missing = sorted(expected - inside)
    assert not missing, f"the wheel lacks {len(missing)} file(s) of the source tree: {missing}"
    extra = sorted(inside - expected)
    assert not extra, f"the wheel holds files that are not in the source tree: {extra}"


def test_the_wheel_declares_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(entry_points).decode()
    assert "agentserver = agentserver.cli.main:main" in text
